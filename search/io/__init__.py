"""Reading and writing files, the one domain error, the one argparse constructor and its argument types, the shared
text pieces and the memory unit: what every command's input and output goes through.
"""
