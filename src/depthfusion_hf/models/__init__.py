"""The model families, one flat folder: a saved remote-code folder gets a family's files and depthfusion_common.py."""
