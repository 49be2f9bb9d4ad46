import sys


def count_words(text):
    """Number of words in text."""
    if not text:
        return 0
    return len(text.split(" "))


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        print(count_words(f.read()))
