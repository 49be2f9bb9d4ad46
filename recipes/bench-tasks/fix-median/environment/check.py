from stats import median

for values in ([3, 1, 2], [1, 2, 3, 4], [5]):
    print(values, "->", median(values))
