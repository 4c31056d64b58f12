"""Building batch scripts for distributed PyTorch jobs, and submitting them."""
