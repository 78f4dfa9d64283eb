"""Model definitions (the Llama family), built-in shapes and the weight loader."""
