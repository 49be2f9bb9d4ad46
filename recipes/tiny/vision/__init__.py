"""The bundled model's vision tower: synthetic pictures (data.py), training (train.py), held-out accuracy (accuracy.py)."""
