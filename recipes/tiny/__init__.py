"""The bundled dsv41-tiny model: data build, training recipe and evaluation."""
