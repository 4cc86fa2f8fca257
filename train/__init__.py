"""Training stages: `python -m train.eagle` trains the EAGLE draft head."""
