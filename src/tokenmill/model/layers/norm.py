import torch

from tokenmill.kernels import cpu_kernels


class RMSNorm(torch.nn.Module):
    """Computed in float32 and cast back, as Hugging Face does (exact parity in fp32).
    On CPU a fused C++ kernel does the same math in one pass; the residual add before it
    fuses into the same pass (vLLM's fused_add_rms_norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`: (norm(x + residual), x + residual), the C++ kernel
        updating both in place (x must then be a tensor the caller no longer needs)."""
        ops = cpu_kernels.ops_for(x)
        if residual is not None:
            if ops is not None and x.is_contiguous() and residual.is_contiguous():
                ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
                return x, residual
            residual = x + residual
            return self(residual), residual
        if ops is not None:
            return ops.rms_norm(x.contiguous(), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
