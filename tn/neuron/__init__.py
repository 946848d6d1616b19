# tn.neuron: the software NeuronCore (architecture numbers, checked ISA, runtime and timing), knows nothing of tracing.
"""The software NeuronCore: architecture configurations, instruction set, runtime and timing model."""
