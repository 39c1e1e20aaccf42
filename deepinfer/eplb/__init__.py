"""Expert-parallel load balancing: where each MoE layer's experts live (`placement`), and the engine-side
balancer that counts expert load and switches placements while serving (`balancer`)."""
