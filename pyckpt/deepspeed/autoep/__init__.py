"""AutoEP (DeepSpeed's automatic expert parallelism), split by concern: the layer metadata and
expert placement (``layers``), the ZeRO-1/2 and partition-native ZeRO-3 expert consolidations
(``zero12``, ``zero3``), and the load side's expert slicing (``load``)."""
