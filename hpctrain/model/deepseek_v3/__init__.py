"""model.arch = "deepseek_v3" (DeepSeek-V3-style: multi-head latent attention, shared + routed
experts with the sigmoid, group-limited router and the auxiliary-loss-free balancing bias, the
first layers dense): spec.py (registration, torch-free), args.py (its [model] keys and rules),
rope.py, attention.py and model.py (the modules), hf.py (Hugging Face DeepseekV3ForCausalLM both
ways), tensor_parallel.py (its TP plan) and shape.py (the planner's arithmetic)."""
