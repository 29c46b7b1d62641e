"""The parallel layouts: the rank grid and DeviceMesh, and each parallelism applied in parallelize's fixed order."""
