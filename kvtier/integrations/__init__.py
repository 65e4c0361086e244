"""kvtier inside other serving engines. Each integration is an optional extra that imports its
engine; the rest of kvtier never imports one (`vllm`: `pip install 'kvtier[vllm]'`)."""
