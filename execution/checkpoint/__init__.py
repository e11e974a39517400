"""The checkpoint wing: logical-state I/O, DCP save and load, and HuggingFace import.

Checkpoints hold logical tensors (unsharded, unpadded), so any layout, placement or precision
resumes any checkpoint."""
