"""The namespace of the package's torch.library ops (``ops``, ``traced_ops``, and the C++
kernels ``cpp_launch`` registers for them): the package's import name. A second copy of this
package imported under another name (benchmarks/ab_defaults.py compares two source trees in
one process) then registers its own ops instead of redefining these, which corrupts the ones
already traced."""

NAMESPACE = __name__.partition(".")[0]
