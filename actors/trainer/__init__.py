"""The trainer actor: drives RL steps, collects finished trajectories, publishes policies."""
