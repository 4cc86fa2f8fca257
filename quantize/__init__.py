"""The W4A16 GPTQ intermediate model of the chain (`python -m quantize.w4`)."""
