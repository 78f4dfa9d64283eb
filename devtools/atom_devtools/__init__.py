"""Developer tooling: the local cluster launcher (`devcluster`), image builds and the demo.

Not part of the operator image: the operator never imports this package.
"""
