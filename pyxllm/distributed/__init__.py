"""Several processes working as one model: the tensor-parallel state and collectives
(``parallel_state``), the control channel from rank 0 to the workers (``control``), the master
address (``address``) and the error of multi-process runs (``errors``)."""
