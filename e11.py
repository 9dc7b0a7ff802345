import torch, rewrite, io, warnings
from torch import nn
from torch.export import Dim
class M(nn.Module):
    def forward(s,x):
        if x.shape[0] > 4: y = x * 2.0
        else: y = x * 3.0
        return y * 1.0
m=M()
x=torch.randn(6,3)
ep=torch.export.export(m,(x,),dynamic_shapes=({0:Dim("B",min=5,max=16)},))
gm=ep.module()
res=rewrite.load("/tmp/snapCM/rules/cleanup.rw").apply(gm,example_inputs=(x,))
print(res.counts)
x3=torch.randn(3,3)
try: gm(x3); print("original program accepts batch 3")
except Exception as e: print("original program refuses batch 3:",type(e).__name__,str(e)[:100])
try: res.graph_module(x3); print("rewritten module accepts batch 3")
except Exception as e: print("rewritten module refuses batch 3:",type(e).__name__,str(e)[:100])
bio=io.BytesIO(); rewrite.capture.save(res.graph_module,bio,level="export",example_inputs=(x,)); bio.seek(0)
p=torch.export.load(bio)
print(p.range_constraints)
try:
    out=p.module()(x3); print("saved .pt2 accepts batch 3; eager model gives", m(x3)[0,0].item()/x3[0,0].item(),"x, .pt2 gives",out[0,0].item()/x3[0,0].item(),"x")
except Exception as e: print(".pt2 refuses batch 3",type(e).__name__,str(e)[:100])
x20=torch.randn(20,3)
try: out=p.module()(x20); print("pt2 accepts 20 (captured max 16)")
except Exception as e: print(".pt2 refuses 20")
