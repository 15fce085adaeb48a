"""Small math helpers."""


def add(a, b):
    return a + b
