from geometry.shapes import area


def total_area(rooms):
    """Sum of the areas of (width, height) rooms."""
    return sum(area(w, h) for w, h in rooms)
