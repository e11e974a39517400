"""Where one rank's state lives and how it moves: buffers on the device or the host, the
weight loads and gathers, the gradient store, RigL's masks and the side streams. It imports
nothing of the step or the update."""
