"""Small helpers shared by decoding, the tools and the trainer."""
