from util import slugify


def main():
    title = "Hello World"
    print(slugify(title))


if __name__ == "__main__":
    main()
