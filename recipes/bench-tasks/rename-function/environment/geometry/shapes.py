def area(width, height):
    """Area of a width x height rectangle."""
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
