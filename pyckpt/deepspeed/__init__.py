"""DeepSpeed's rules: how a ZeRO checkpoint is laid out (discovery, the schema of its pickled
metadata, parameter names), and how ZeRO-1/2, ZeRO-3, AutoTP and AutoEP state maps onto the
Universal Checkpoint layout, expressed as plans of byte copies."""
