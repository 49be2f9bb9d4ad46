from geometry.shapes import area, perimeter

__all__ = ["area", "perimeter"]
