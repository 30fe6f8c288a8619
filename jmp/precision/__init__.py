"""Mixed precision: compute/master dtypes and loss scaling."""
