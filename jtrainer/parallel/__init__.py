"""The mesh and the processes: logical-axis sharding rules (`sharding`) and many hosts as one program
(`distributed`). Imports only jtrainer's core modules."""
