"""Workers run the model on one device; the model runner turns steps into forward passes."""
