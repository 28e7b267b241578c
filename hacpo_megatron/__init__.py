"""hacpo_megatron: train several heterogeneous LLMs together with HACPO on Megatron-core."""
__version__ = "0.1.0"

# First, before Megatron, transformers or Ray are imported anywhere: hide the third-party notices
# listed (each with its reason) in hacpo_megatron/quiet.py. HACPO_SHOW_ALL_WARNINGS=1 shows them.
from hacpo_megatron import quiet as _quiet

_quiet.install()
