"""Kopf operator for AtomDeployment resources."""
