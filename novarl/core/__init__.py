"""Named entry points the NovaRL seed documents (`core.distributed.get_default_fsdp_preset`)."""
