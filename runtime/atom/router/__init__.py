"""atom-router: the prefill/decode proxy of a disaggregated AtomDeployment."""
