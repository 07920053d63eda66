"""The runs made on a lent GPU or TPU machine and their phases."""
