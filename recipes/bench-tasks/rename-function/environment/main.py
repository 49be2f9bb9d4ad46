from geometry import area, perimeter
from geometry.rooms import total_area

rooms = [(3, 4), (5, 2), (2.5, 2)]
print("first room:", area(*rooms[0]), "perimeter", perimeter(*rooms[0]))
print("total area:", total_area(rooms))
