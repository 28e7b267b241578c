"""hacpo_megatron: train several heterogeneous LLMs together with HACPO on Megatron-core."""
__version__ = "0.1.0"
