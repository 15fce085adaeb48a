from dataclasses import dataclass


@dataclass
class Post:
    title: str
    body: str
    published: bool = False
