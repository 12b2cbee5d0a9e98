import torch, time, tempfile, os, torch.distributed as dist
from megatronapp.scan.tracer import Tracer, TraceConfig
from megatronapp.scan.instrument import install_distributed_instrumentation
from megatronapp.scan.format import load_rank_trace
from megatronapp.scan.merge import merge_traces
d=tempfile.mkdtemp()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
meta=dict(rank=0,world_size=1,coords=dict(tp=0,dp=0,pp=0),layout=dict(tp_size=1,pp_size=1,dp_size=1,virtual_pp_size=1))
a=torch.randn(4096,4096,device="cuda",dtype=torch.bfloat16)
def step(tr,it):
  tr.step_begin(it)
  for mb in range(4):
    with tr.context(microbatch=mb), tr.span("forward"):
      for l in range(8):
        with tr.layer_span("mlp", l): b=a@a
      w=dist.all_reduce(b, async_op=True); w.wait()
  tr.step_end(it)
for mode, interval in (("off",1),("on",1),("off",1),("on",1),("on",10),("off",1)):
  tr=Tracer(TraceConfig(enabled=(mode=="on"),trace_dir=d,interval=interval,continuous_iterations=1,granularity="full"),meta,device="cuda")
  inst=install_distributed_instrumentation(tr)
  for it in range(1,4): step(tr,it)
  torch.cuda.synchronize(); t=time.perf_counter()
  for it in range(4,64): step(tr,it)
  host=time.perf_counter()-t; torch.cuda.synchronize(); tot=time.perf_counter()-t
  if inst: inst.uninstall()
  tr.close(); print(mode, interval, "host ms/step %.3f total ms/step %.3f" % (host/60*1e3, tot/60*1e3), flush=True)
tr=Tracer(TraceConfig(enabled=True,trace_dir=d+"/x",interval=1),meta,device="cuda"); tr.step_begin(1)
for n in (1000, 10000):
  t=time.perf_counter()
  for _ in range(n):
    with tr.span("forward", microbatch=1): pass
  print("per span us", (time.perf_counter()-t)/n*1e6)
tr.step_end(1); tr.close()
tr=load_rank_trace(os.path.join(d,"rank00000.mscan"))
rows=tr.events.to_pylist(); print(tr.meta["device"], tr.meta["clock"], len(rows))
it5=[r for r in rows if r["iteration"]==5]
for r in it5[:3]+it5[-4:]: print(r["name"],r["cat"],r["microbatch"],r["layer"],r["op"],r["group"],r["seq"],r["bytes"],(r["end_ns"]-r["start_ns"])/1e3,"us")
cal=[r for r in rows if r["cat"]=="calib"]; print("calib", len(cal), cal[0]["end_ns"]-cal[0]["start_ns"], cal[-1]["end_ns"]-cal[-1]["start_ns"])
s=merge_traces(d, d+"/o.json.gz"); print(s.events, s.flows, round(s.events_per_s), s.report.to_dict()["violations"])
dist.destroy_process_group()
