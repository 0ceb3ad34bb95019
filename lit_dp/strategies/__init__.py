"""The Lightning layer: the Trainer's and Fabric's strategies, and what they share."""
