"""What a job costs without building it: per-rank memory, FLOPs, and the devices' memory and peak FLOPS."""
