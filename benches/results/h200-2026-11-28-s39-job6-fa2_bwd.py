# SDPA flash (FlashAttention-2) causal forward + backward, bf16 [4, 16, 4096, 128], three times (for ncu).
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16)
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for _ in range(3):
        q.grad = k.grad = v.grad = None
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
torch.cuda.synchronize()
