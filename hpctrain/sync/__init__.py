"""Communication-light training: DiLoCo / overlapped Local-SGD with compressed pseudo-gradients
(diloco.py, compress.py) and asynchronous SGD against MPI one-sided parameter servers
(param_server.py). See docs/communication.md."""
