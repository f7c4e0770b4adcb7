import torch, triton
from lm_core import qkv_rope_triton as R
from lm_core.model import RotaryEmbedding
for (b, t, nq, nkv, d) in [(4, 512, 25, 25, 64), (1, 4096, 32, 8, 128)]:
    rope = RotaryEmbedding(d, t, 10000.0).cuda()
    qkv = torch.randn(b, t, nq + 2 * nkv, d, device="cuda", dtype=torch.bfloat16)
    g = [torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for h in (nq, nkv, nkv)]
    ref = None
    for el in (512, 1024, 2048, 4096):
        for w in (2, 4, 8):
            R.ELEMENTS, R.WARPS = el, w
            out = R.forward(qkv, rope.cos, rope.sin, nq, nkv); dq = R.backward(*g, rope.cos, rope.sin)
            if ref is None: ref = (out, dq)
            diff = max((a.float() - b_.float()).abs().max().item() for a, b_ in zip((*out, dq), (*ref[0], ref[1])))
            f = triton.testing.do_bench_cudagraph(lambda: R.forward(qkv, rope.cos, rope.sin, nq, nkv), rep=50, return_mode="median")
            bw = triton.testing.do_bench_cudagraph(lambda: R.backward(*g, rope.cos, rope.sin), rep=50, return_mode="median")
            print(f"{(b,t,nq,nkv,d)} elements {el:5d} warps {w}: fwd {f*1e3:6.1f} us bwd {bw*1e3:6.1f} us  max diff vs first {diff:.3g}", flush=True)
