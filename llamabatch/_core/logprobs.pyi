import numpy as np
import numpy.typing as npt

def row_top_logprobs(logits: npt.NDArray[np.float32], n: int, token: int) -> dict[int, float]: ...
