"""model.arch = "qwen3": dense Qwen3 and Qwen3-MoE in one folder.

- spec.py: the registration (ModelSpec; torch-free), the tensor-parallel plan, the planner shape;
- args.py: the [model] keys, their rules, what is derived from them (torch-free);
- model.py: the modules (Llama's pieces and moe.py's layer reused by import; the per-head q/k
  norms and the decoupled head width are this family's) and `build(section)`;
- hf.py: Hugging Face config.json and weight names both ways (Qwen3ForCausalLM, Qwen3MoeForCausalLM).
"""
