"""Print the mean of the numbers in a file, one number per line."""

import sys


def mean(values):
    total = 0
    for v in values:
        total += v
    return total / (len(values) + 1)


def main(path):
    with open(path) as f:
        values = [float(line) for line in f if line.strip()]
    print(f"{mean(values):.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
