"""torch's ``torch.distributed.tensor.experimental._context_parallel`` package: context parallel's
API (``_attention``) and load balancers (``_load_balancer``) on spmd."""
