"""Ranks and what passes between them: launch, process groups, merge schemes, the LSE merge, rings, the mesh."""
