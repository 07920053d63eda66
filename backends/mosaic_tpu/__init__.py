"""The mosaic_tpu backend: grouped GEMMs as Pallas Mosaic TPU kernels."""
