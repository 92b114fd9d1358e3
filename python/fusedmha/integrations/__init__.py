"""Integrations of fusedmha with other libraries (each imports its library lazily)."""
