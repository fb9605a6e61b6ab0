"""The environment actor: owns trajectories, runs their agent loops, calls (modelled) tools."""
