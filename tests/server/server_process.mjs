// Starts `dsv4 serve` on a free port for a node test and stops it (SIGTERM) afterwards. DSV4_SERVE_ARGS (flags
// separated by spaces) go to every server a test starts: ctest runs the same tests over --data-parallel-size 2.
import { spawn } from 'node:child_process';
import { once } from 'node:events';

export const API_KEY = 'dsv4-test-key';

export async function startServer(extraArgs = []) {
  const binary = process.env.DSV4_BIN;
  if (!binary) throw new Error('DSV4_BIN must point at the dsv4 binary');
  const common = (process.env.DSV4_SERVE_ARGS || '').split(' ').filter((arg) => arg.length > 0);
  const child = spawn(binary, ['serve', '--port', '0', '--api-key', API_KEY, ...common, ...extraArgs],
                      { stdio: ['ignore', 'pipe', 'pipe'] });
  let stderr = '';
  child.stderr.on('data', (chunk) => { stderr += chunk; });
  const port = await new Promise((resolve, reject) => {
    let stdout = '';
    const timer = setTimeout(() => reject(new Error('dsv4 serve did not start: ' + stdout + stderr)), 60000);
    child.stdout.on('data', (chunk) => {
      stdout += chunk;
      const match = /on http:\/\/[^:]+:(\d+)/.exec(stdout);
      if (match) { clearTimeout(timer); resolve(Number(match[1])); }
    });
    child.on('exit', (code) => { clearTimeout(timer); reject(new Error(`dsv4 serve exited ${code}: ${stderr}`)); });
  });
  const baseURL = `http://127.0.0.1:${port}`;
  return {
    port, baseURL, child,
    stderr: () => stderr,
    async stop() {
      if (child.exitCode !== null) return child.exitCode;
      child.kill('SIGTERM');
      const [code] = await once(child, 'exit');
      return code;
    },
  };
}

// The Prometheus text of /metrics as {"name{labels}": value}.
export async function metrics(baseURL) {
  const text = await (await fetch(baseURL + '/metrics')).text();
  const values = {};
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const space = line.lastIndexOf(' ');
    values[line.slice(0, space)] = Number(line.slice(space + 1));
  }
  return values;
}
